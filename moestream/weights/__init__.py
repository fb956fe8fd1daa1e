"""Model weights: GGUF and safetensors readers, quant types, dequantization, quantizers, writer."""
