"""The rollout producer (loop.max_staleness >= 1): server.py is the long-lived process that keeps
generating into the run's rollout buffer; buffer.py is the buffer's layout and the steps' side of it
(the generate step takes finished groups, sync_weights retires them exactly once)."""
