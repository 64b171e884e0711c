"""Connects to its socket like a serve worker, then speaks garbage."""

import os
import socket
import time

sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(os.environ["GPUWARDEN_SERVE_SOCKET"])
sock.sendall(b"\xff\xff\xff\xffthis is not a frame")
time.sleep(30)
