"""Test helpers: tiny models, an oracle forward pass, tolerances. Never imported by library code."""
