"""The Slurm resources of a job, declared once: ``JobResources``, the base of every model that becomes a job
(a server job; each array task of a client group).

The fields (partition, CPUs, memory, time limit) and their checks are declared here. Each job model gives, in
``RESOURCES``, its own default and help for each of them and the field it follows: pydantic puts a base's
fields first, and the field order is what a user reads (the keys of the frozen ``RUN/topology.yaml``, which an
existing run compares on resume, the keys an unknown-key error lists, docs/config.md), so the subclass's
fields are put back in that order when it is defined (``__pydantic_init_subclass__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from ajet_hpc.config.fields import MODEL_CONFIG, Partition, SlurmMemory, SlurmTime, slurm_time_minutes


@dataclass(frozen=True)
class Slot:
    """One resource field in a job model: the field it follows there, its default and its help."""

    after: str
    default: str | int
    description: str


class JobResources(BaseModel):
    """The Slurm resources of one job: its partition, CPUs per task, memory and time limit.

    What the launcher and the consistency checks ask of any job (``time_min`` included), typed once."""

    model_config = MODEL_CONFIG

    RESOURCES: ClassVar[dict[str, Slot]] = {}
    """Per job model, in an order where each field follows one placed before it (see the module doc)."""

    # each job model replaces these defaults and descriptions with its own (RESOURCES)
    partition: Partition = Field(default="cpu", description="Slurm partition of the job.")
    cpus: int = Field(default=1, ge=1, description="CPUs per task (--cpus-per-task).")
    mem: SlurmMemory = Field(
        default="2G", description="Memory: an integer with optional K/M/G/T suffix (MB without one)."
    )
    time: SlurmTime = Field(
        default="4:00:00", description="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        slots = cls.__dict__.get("RESOURCES")
        if slots is None:  # a subclass of a job model keeps its base's order
            return
        if set(slots) != set(JobResources.model_fields):
            raise TypeError(
                f"{cls.__name__}.RESOURCES must place exactly these fields: "
                + ", ".join(JobResources.model_fields)
            )
        fields = cls.__pydantic_fields__
        order = [name for name in fields if name not in slots]
        for name, slot in slots.items():
            if slot.after not in order:
                raise TypeError(
                    f"{cls.__name__}.RESOURCES: {name} follows {slot.after!r}, which is not among the "
                    "fields placed before it"
                )
            order.insert(order.index(slot.after) + 1, name)
            fields[name] = FieldInfo.merge_field_infos(
                fields[name], default=slot.default, description=slot.description
            )
        cls.__pydantic_fields__ = {name: fields[name] for name in order}
        cls.model_rebuild(force=True)

    @property
    def time_min(self) -> int:
        """The time limit in whole minutes (seconds round up)."""
        return slurm_time_minutes(self.time)
