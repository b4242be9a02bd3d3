"""Kernels: attention (paged, `kvjax.kernels.paged_attention`; the dense oracle) and the KV codec
kernels, each with a pure-jnp reference. Imports no other kvjax room; codec ids, levels and the chunk-size rule are the
registry's (`kvjax.codecs`)."""

from kvjax.kernels.attention import dense_attention_reference
from kvjax.kernels.kv_codec import (kv_decode, kv_encode, kv_encode_host, payload_arrays,
                                    payload_from_arrays)
from kvjax.kernels.kv_codec_ref import (CACHEGEN_LEVEL_BINS, dequantize_reference,
                                        encode_reference, kv_decode_reference)
from kvjax.kernels.kv_payloads import (CacheGenPayload, Int4Payload, Int8Payload, Payload,
                                       RawPayload, codec_of, validate_payload)

__all__ = ["CACHEGEN_LEVEL_BINS", "CacheGenPayload", "Int4Payload",
           "Int8Payload", "Payload", "RawPayload", "codec_of", "dense_attention_reference",
           "dequantize_reference", "encode_reference", "kv_decode", "kv_decode_reference",
           "kv_encode", "kv_encode_host", "payload_arrays", "payload_from_arrays",
           "validate_payload"]
