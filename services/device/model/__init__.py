"""The device's model layer: the decoder's forward pass, its config and weights, RoPE and the paged KV pool."""
