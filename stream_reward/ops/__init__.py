"""Operations: settings, the worker command line, status, dead letters, logs, the embedded server."""
