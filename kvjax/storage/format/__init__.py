"""Byte formats and keys: plain records, checksums, chunk keys, codec payloads, entropy coders
(rANS) and the store's object names (no I/O)."""
