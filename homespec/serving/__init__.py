"""The daemon and what it serves: the host (a loaded model set wired to its proposers,
controller and engine), the worker and its queue, the HTTP app and its API schemas, stats and
metrics, the bench that drives the host, and the systemd unit."""
