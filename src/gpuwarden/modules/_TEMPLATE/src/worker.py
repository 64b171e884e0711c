"""A template warm server: write ``load`` and ``handle``; gpuwarden does the rest.

``load`` runs once, when the first job of this type arrives; whatever it returns
is handed to ``handle`` for every job. ``handle`` returns the job's message; an
exception fails that job (never retried) and the server goes on serving.
``device_bytes`` says how much of the model sits in GPU memory after the load
(the placement check compares it with ``expected_device_gib``).
"""

import json

from gpuwarden.server.worker import JobContext, LoadContext, serve


def load(ctx: LoadContext) -> dict:
    # Load your model onto the one visible GPU (ctx.gpu) here, e.g.
    #   model = AutoModel.from_pretrained(path).to("cuda")
    return {"greeting": "hello"}


def handle(model: dict, job: JobContext) -> str:
    prompt = job.params["prompt"]
    (job.output_dir / "result.json").write_text(json.dumps({"echo": prompt}))
    return f"{model['greeting']}, {prompt}"


def device_bytes(model: dict) -> int | None:
    # e.g. sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    return None


if __name__ == "__main__":
    serve(load, handle, device_bytes=device_bytes)
