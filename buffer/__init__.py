"""The rollout hub: a Redis-backed replay buffer fed over ZeroMQ."""
