"""Ray Serve application builders (import_path: deployments.<module>:build_app)."""
