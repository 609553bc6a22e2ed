"""The device's model layer: the decoder every family runs, its config and weights, RoPE and the paged KV pool;
one module per family in ``families/`` (``README.md`` here: the parts, and the steps to add a family)."""
