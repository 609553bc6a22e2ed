"""The device's compute kernels: the fused CPU ops and their C++ sources, weight-only quantized linears, the CPU budget and thread governor."""
