"""The turn runtime: one agent turn as a task graph (LLM stream, tap, speculative branches, commit); its public
names are ``bunshin_async.speculation``'s."""
