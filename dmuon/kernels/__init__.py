"""GPU kernels (Triton) for the symmetric products of Newton–Schulz; CPU-safe to import."""
