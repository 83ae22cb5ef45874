"""Ray Serve's side: the app's arguments, the replica, its OpenAI app and metrics, and the
KV-capacity autoscaling policy."""
