"""echo.serve: the smallest warm server. Follows docs/MODULE_GUIDE.md, section 8.

``load`` loads nothing (it only notes the GPU it was given); each job writes
its ``text`` to ``output`` in the job's output directory, as echo.echo does.
"""

from gpuwarden.server.worker import JobContext, LoadContext, serve


def load(ctx: LoadContext) -> dict:
    return {"gpu": ctx.gpu}


def handle(model: dict, job: JobContext) -> str:
    text = job.params["text"]
    output = job.params.get("output", "echo.txt")
    out_dir = job.output_dir.resolve()
    target = (out_dir / output).resolve()
    if not target.is_relative_to(out_dir):
        raise ValueError(f"output {output!r} must stay inside the output directory")
    repeat = int(job.params.get("repeat", 1))
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w") as f:
        for _ in range(repeat):
            f.write(text)
    return f"wrote {len(text) * repeat} characters to {output}"


def device_bytes(model: dict) -> int | None:
    return None  # nothing of it is in GPU memory


if __name__ == "__main__":
    serve(load, handle, device_bytes=device_bytes)
