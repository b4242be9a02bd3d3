"""Chat sessions: the exact token ids of a conversation's last turn, so that the next turn's
prompt extends them instead of re-tokenizing the whole conversation (CachedAttention, arXiv
2403.19708, section 3; the extension SGLang calls `session_id`).

Why. Re-tokenizing a whole conversation need not give back the ids the model generated: BPE can
merge across the turn boundary, and a generated "\\n" "\\n" re-tokenizes as "\\n\\n". The prefix
cache (device blocks, stored chunks) is keyed by token ids, so such a drift cuts the hit short at
the first differing token. A session keeps the ids of the last finished turn (its prompt ids
followed by its output ids) and builds the next prompt as those ids plus the tokens of the new
part only, so the hit covers every earlier token.

The extension rule (`chat_prompt`). A new conversation EXTENDS the session's last turn when its
messages are that turn's messages followed by one assistant message whose content equals that
turn's output text (and more messages, usually the user's next one). Then, with the new
conversation rendered by the model's chat template as `text`:

    head   = last.prompt_text + last.output_text        text must start with head
    start  = len(head) (+ len(eos text) when the last output ended with the EOS token: those
             ids already hold the template's end-of-turn token, so it is not added twice)
    prompt = last.token_ids + encode_chat_suffix(messages, start)

The suffix is tokenized as `encode_chat` tokenizes a prompt (special tokens written by the
TEMPLATE are control tokens, message content is plain text) with no BOS. An output that stopped
on length has no end-of-turn token, so the template's one is added as tokens. Anything else
(edited history, another reply text, fewer messages, a template that renders the earlier turns
differently, a last turn whose output ids do not spell its text: a stop string, or special tokens
generated inside the reply) is NOT an extension: the prompt is the normal templated one, and that
turn is counted as a miss (`SessionStats.not_extended`).

Ownership. `SessionRegistry` owns every session (one lock; plain Python, no timer thread); the
offline `LLM` creates one and the server (`kvjax.serve`) uses that same registry, and both plan a
turn with `run_turn` (`kvjax/sessions/turn.py`: the extension rule, the truncation limit with its
one output-token reservation, re-rotation), so there is one session-turn flow. Sessions
are keyed by `(cache_salt, session_id)`: a request under another salt never sees another salt's
session. Each session holds its last finished turn (`Turn`), its last-use time and a busy flag
(a turn in flight holds a lease; a second turn on a busy session is refused with `SessionBusy`).
An aborted or failed turn is released, leaving the session as it was. Expired sessions (idle
longer than the TTL) are dropped lazily, on access and admission; over `max_sessions` or
`max_tokens` the least recently used idle session is dropped first, and a busy one never is.

Persistence (`set_persistence`; the `LLM` turns it on when its store's first persistent tier is
a local directory: `<store>/sessions/<model fingerprint>/`). Each open session's last finished
turn is also a small JSON file (`SessionFiles`: the turn's messages, prompt text, exact token
ids, reply; written atomically, mode 0600, named by a digest of the model fingerprint, salt and
session id; the salt itself is kept only as a digest), so a restarted server over the same store
folder extends the conversation and its next turn loads the stored tail. A session not in memory
is read back from its file on first use; a file under another model, salt or id is ignored.
Closing, expiring (idle past the TTL, by wall clock across restarts) or evicting a session
deletes its file; at start, expired files and the oldest beyond `max_sessions` are deleted.
Without a local store (no store, memory://, s3://) sessions live in memory only.

KV pinning (CachedAttention, arXiv 2403.19708, section 3.3: the KV of a conversation that will
come back is kept in the fast tier). The registry says which sessions are pinned
(`SessionRegistry.pinned`): open sessions with a finished turn, most recently used first, at most
`max_pinned_sessions` of them and `max_pinned_bytes` of their full chunks (the least recently
used, i.e. the oldest idle, go first). Whenever that list changes (a turn finished, a session
closed, expired or dropped) it is handed to a sink (`set_pin_sink`; the `LLM` passes the store
client's `set_pins`, which keeps those sessions' chunks in the host tier against eviction), so
closing or expiring a session unpins its KV.

Modules (each plain Python, importing no other kvjax room): `types` (ids, limits, records),
`prompt` (the extension rule), `truncation` (cuts and the re-rotated namespace), `persistence`
(session files), `registry` (`SessionRegistry`), `turn` (`run_turn`, `TurnPlan`).
"""

from kvjax.sessions.persistence import SESSION_FILE_VERSION, SessionFiles
from kvjax.sessions.prompt import chat_prompt, record_turn
from kvjax.sessions.registry import SessionRegistry
from kvjax.sessions.truncation import (DROP_OLDEST_TURNS, REROTATED_SALT_PREFIX, TRUNCATE_NONE,
                                       TRUNCATION_POLICIES, KeptSpan, Truncation,
                                       check_client_salt, is_rerotated_salt, message_segments,
                                       rerotation_salt, truncate_prompt)
from kvjax.sessions.turn import (StageFn, TurnPlan, output_reservation, prompt_limit,
                                 run_turn)
from kvjax.sessions.types import (DEFAULT_MAX_PINNED_SESSIONS, DEFAULT_MAX_SESSION_TOKENS,
                                  DEFAULT_MAX_SESSIONS, DEFAULT_REROTATE_BOUNDARY_CHUNKS,
                                  DEFAULT_SESSION_TTL_S, EXTENDED, FIRST, NOT_EXTENDED,
                                  SESSION_ID_RE, ChatPrompt, Message, PinnedSession, SessionBusy,
                                  SessionConfig, SessionInfo, SessionStats, SessionTurn, Turn,
                                  check_session_id)

__all__ = [
    "DEFAULT_MAX_PINNED_SESSIONS", "DEFAULT_MAX_SESSION_TOKENS", "DEFAULT_MAX_SESSIONS",
    "DEFAULT_REROTATE_BOUNDARY_CHUNKS", "DEFAULT_SESSION_TTL_S", "DROP_OLDEST_TURNS", "EXTENDED",
    "FIRST", "NOT_EXTENDED", "REROTATED_SALT_PREFIX", "SESSION_FILE_VERSION", "SESSION_ID_RE",
    "TRUNCATE_NONE", "TRUNCATION_POLICIES", "ChatPrompt", "KeptSpan", "Message", "PinnedSession",
    "SessionBusy", "SessionConfig", "SessionFiles", "SessionInfo", "SessionRegistry",
    "SessionStats", "SessionTurn", "StageFn", "Truncation", "Turn", "TurnPlan", "chat_prompt",
    "check_client_salt", "check_session_id", "is_rerotated_salt", "message_segments",
    "output_reservation",
    "prompt_limit", "record_turn", "rerotation_salt", "run_turn", "truncate_prompt",
]
