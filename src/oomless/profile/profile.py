"""The Profile: what one measured training step says about a model, per block (plain data)."""

import json
from dataclasses import asdict, dataclass, field


@dataclass
class BlockProfile:
    name: str
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    saved_bytes: int = 0            # storages this block saved first (views / repeats counted once)
    largest_saved_bytes: int = 0    # its largest single storage
    input_bytes: int = 0
    output_bytes: int = 0
    parameter_bytes: int = 0
    calls: int = 0


@dataclass
class LinkProfile:
    """Measured bandwidth of the swap tier, bytes per second, each direction."""

    kind: str                       # "pcie" (pinned host <-> CUDA) or "disk"
    out_bytes_per_second: float
    in_bytes_per_second: float


@dataclass
class Profile:
    device: str
    blocks: list[BlockProfile]
    parameter_bytes: int
    gradient_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int
    input_bytes: int
    unassigned_saved_bytes: int     # saved by ops outside every block: always kept
    loss_seconds: float
    link: LinkProfile
    notes: list[str] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return sum(block.saved_bytes for block in self.blocks) + self.unassigned_saved_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        data["blocks"] = [BlockProfile(**block) for block in data["blocks"]]
        data["link"] = LinkProfile(**data["link"])
        return cls(**data)
