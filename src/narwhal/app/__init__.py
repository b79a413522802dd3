"""The process assembled: every part built and wired (`process`), the servers bound (`server`)."""
