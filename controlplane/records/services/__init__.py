"""Services: one use case each, over repositories and the config store; they commit."""
