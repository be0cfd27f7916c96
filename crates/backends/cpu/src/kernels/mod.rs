//! Quantized dot-product kernels, one module per family, with run-time ISA dispatch.
