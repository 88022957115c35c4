"""Terminal dashboard of a running daemon (Textual). It reads the daemon over HTTP only —
/v1/homespec/stats, and the admin endpoints for the keys — and never imports the engine."""
