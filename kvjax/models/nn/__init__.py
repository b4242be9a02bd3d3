"""The model: LLaMA-family decoder in Flax NNX, its config and presets, the building blocks, the
paged KV pool record it reads and writes, and the dense functions kvtc calibration runs."""
