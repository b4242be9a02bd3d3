"""Running a model: the Runner protocol and its records, the paged runner and its layer-wise, codec
and step-input programs, pool and weight sizing, sharding, multi-host, the connector's device
seam, JAX's compilation cache."""
