"""Speculative decoding on the device: draft proposers, the draft model, verification, and the measured step costs."""
