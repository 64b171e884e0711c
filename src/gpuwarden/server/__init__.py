"""Warm model servers (launch mode ``serve``): the wire protocol between the broker
and a serve worker (:mod:`gpuwarden.server.protocol`) and the helper a module
author's worker is written with (:mod:`gpuwarden.server.worker`).

The broker side of one worker process lives in :mod:`gpuwarden.launch.warmproc`.
Nothing here imports the broker: a worker process imports only this package
(and :mod:`gpuwarden.errors`).
"""
