"""Running the daemon in production: the process (process: signals, exit status), its
start-up (startsignals, startfaults) and shutdown (teardown), logging (logsetup, grpclog,
ratelog), systemd readiness (sdnotify), counter watches (watch), SIGHUP reloads (reload)
and the garbage-collector policy (gcpolicy)."""
