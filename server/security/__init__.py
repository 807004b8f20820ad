"""Who may call what: the listener policy and bearer tokens (auth, tokens), the socket's group
(access), and the identity each session belongs to (identity)."""
