"""Loading a model: Orbax checkpoints of converted parameters, GGUF and safetensors readers, Hugging
Face hub ids, tokenizers, the model registry, fingerprints and kvtc calibration."""
