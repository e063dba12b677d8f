"""toolrl: shared internals of the tool-interleaved GRPO system."""
