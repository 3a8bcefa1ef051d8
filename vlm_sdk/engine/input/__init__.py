"""Input processing on the caller's (or a prep pool's) thread: text and image limits checked before
anything is decoded (`PromptGuard`), special-token text escaped, prompts tokenized (huge texts in a child
process). The family's processor (models/<family>/processor.py) turns messages into `PromptInputs`.
A request's sampling settings are checked against the vocabulary and the engine's limits
(`sampling_check`)."""
