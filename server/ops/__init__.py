"""Running the daemon in production: logging (logsetup, grpclog, ratelog), systemd readiness
(sdnotify), counter watches (watch), SIGHUP reloads (reload) and the garbage-collector policy
(gcpolicy)."""
