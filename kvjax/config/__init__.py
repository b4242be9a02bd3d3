"""One configuration tree: every engine option declared once (`kvjax.config.options`).

`EngineOptions` composes the sections (`ModelOptions`, `CacheOptions`, `SchedulerOptions`,
`KVStoreOptions`, `SessionOptions`, `ParallelOptions`); `LLM(...)` takes it (or the flat
keywords), the server generates its flags from the same fields, and
`scripts/gen_options_doc.py` writes docs/usage/options.md from them.
"""

from kvjax.config.fields import (FLAG_KINDS, OptionSpec, field_default, flag_default, option,
                                 option_fields, spec)
from kvjax.config.options import (DEFAULT_MAX_NUM_SEQS, DTYPES, MERGE_MODES, SECTIONS,
                                  SESSION_TRUNCATIONS, CacheOptions, EngineOptions,
                                  KVStoreOptions, ModelOptions, ParallelOptions,
                                  SchedulerOptions, SessionOptions, all_option_fields,
                                  check_scheduling_options, server_defaults)

__all__ = ["FLAG_KINDS", "OptionSpec", "field_default", "flag_default", "option",
           "option_fields", "spec", "DEFAULT_MAX_NUM_SEQS", "DTYPES", "MERGE_MODES", "SECTIONS",
           "SESSION_TRUNCATIONS", "CacheOptions", "EngineOptions", "KVStoreOptions",
           "ModelOptions", "ParallelOptions", "SchedulerOptions", "SessionOptions",
           "all_option_fields", "check_scheduling_options", "server_defaults"]
