"""Model endpoints: a streaming chat-completions client, the tool-call tap, the replay server (public names in
``bunshin_async.llm``)."""
