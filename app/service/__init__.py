"""The proxy service: the app, its routes, the upstream pool, settings and errors: everything that knows HTTP exists."""
