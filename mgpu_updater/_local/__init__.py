"""Replicas in worker processes on this host: one worker per extra device.

- :mod:`.group`: the master's side (:class:`~.group.LocalGroup`);
- :mod:`.pool`: starting, watching and stopping the worker processes;
- :mod:`.worker`: the worker process's entry point and serve loop;
- :mod:`.protocol`: the messages, the collective order and both halves of one step.
"""
