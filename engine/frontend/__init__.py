"""Request frontend: text and prompt layout, languages, instructs, duration, chunking, audio, prompts."""
