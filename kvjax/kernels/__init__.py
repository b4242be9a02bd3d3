"""Kernels: attention over the slotted KV cache (and, later, KV codec kernels), each with a
pure-jnp reference. Imports no other kvjax room."""

from kvjax.kernels.attention import (DEFAULT_BLOCK_SIZE, dense_attention_reference,
                                     ragged_cache_attention_reference)

__all__ = ["DEFAULT_BLOCK_SIZE", "dense_attention_reference", "ragged_cache_attention_reference"]
