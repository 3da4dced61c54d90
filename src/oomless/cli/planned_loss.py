"""The loss `oomless plan` and `oomless simulate` plan for a model built by name (``--loss``).

    oomless plan hf:gpt2 --input-shape 8,512 --memory 2GiB --loss fused-next-token
    oomless simulate transformer --input-shape 1,128 --global-batch 64 --gpus 16 --loss sum

Registered models return logits, not a loss. A language model (``transformer``, ``hf:...``) trains
on next-token cross-entropy, which keeps the log-probabilities for its backward and makes the
logits' gradient whole, where a sum of the logits keeps nothing: planning the sum would promise
memory the real step does not have. Both commands take the same choices, default and errors from here.
"""

import argparse

from oomless.errors import InputError

LOSSES = ("auto", "sum", "next-token", "fused-next-token")


def add_loss_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loss", choices=LOSSES, default="auto",
                        help="the loss planned: sum (of the outputs), next-token (cross-entropy of each token's "
                             "logits against the next token), fused-next-token (hf: models; the model without its "
                             "head, oomless.linear_cross_entropy); auto (default): next-token for transformer and "
                             "hf: models, else sum")


def is_language_model(model_name: str) -> bool:
    return model_name == "transformer" or model_name.startswith("hf:")


def check_loss(loss: str, model_name: str) -> None:
    """``--loss`` against the model's name, before the model is built."""
    if loss == "next-token" and not is_language_model(model_name):
        raise InputError(f"--loss next-token is for language models (transformer, hf:...), not {model_name!r}; "
                         "use --loss sum")
    if loss == "fused-next-token" and not model_name.startswith("hf:"):
        raise InputError(f"--loss fused-next-token plans a Hugging Face causal LM without its head (hf:...), not "
                         f"{model_name!r}; use --loss next-token")


def resolve_loss(loss: str, model_name: str) -> str:
    """``--loss`` with ``auto`` resolved: next-token for a language model, else sum."""
    if loss == "auto":
        return "next-token" if is_language_model(model_name) else "sum"
    return loss


def planned_step(loss: str, model_name: str, model, example):
    """(the module planned, its loss function) for ``--loss``: a language model's next-token
    cross-entropy (the logits of positions 0..T-2 against tokens 1..T-1), or with the head fused,
    the Hugging Face model's ``base_model`` and `oomless.linear_cross_entropy` over its states and
    the head's weight; else the sum of the outputs (registered models return logits, not a loss)."""
    import torch.nn.functional as F

    import oomless

    loss = resolve_loss(loss, model_name)
    if loss == "sum":
        return model, oomless.sum_of_outputs
    if loss == "fused-next-token":
        head = model.get_output_embeddings()
        return model.base_model, lambda out: oomless.linear_cross_entropy(
            out.last_hidden_state[:, :-1], head.weight, example[:, 1:])

    def next_token(out):
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), example[:, 1:].flatten())
    return model, next_token
