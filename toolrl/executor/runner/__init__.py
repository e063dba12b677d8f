"""The child side: a runner process, forked from a zygote, that runs one execution or a session's blocks."""
