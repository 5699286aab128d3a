"""Parameter servers a user might pick instead of gemps, written against their public APIs."""
