"""The daemon's HTTP routes, one router per concern; `homespec.serving.app` includes them.

Handlers are module-level functions that find the daemon (and through it the config) and the
advertised address on `request.app.state`, which `create_app` fills: the routers hold no state.
"""
