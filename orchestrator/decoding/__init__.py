"""Decoding: the schedule's pure decisions and the one loop that carries them out.

Pure: no Ray, no sockets, no llama.cpp. The loop drives any ``Target``
(a socket pipeline, stages in this process, simulated stages) and takes its
requests from ``orchestrate run``, ``orchestrate serve``'s service or the
planner's simulation.
"""
