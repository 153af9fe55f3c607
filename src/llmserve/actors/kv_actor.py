"""KV-manager actor: fits each StepProposal into the block pool (KVCacheManager) and sends the
plan on to the executor and the feedback back to the scheduler."""

from __future__ import annotations

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.messages import FinishInFlight


class KVActor:
    def __init__(self, manager: KVCacheManager, *, inbox: ObjectReceiveStream, to_executor: ObjectSendStream,
                 to_scheduler: ObjectSendStream) -> None:
        self.manager = manager
        self.inbox, self.to_executor, self.to_scheduler = inbox, to_executor, to_scheduler

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox:
            async for proposal in self.inbox:
                if isinstance(proposal, FinishInFlight):
                    await self.to_executor.send(proposal)  # in order behind the plans before it
                    continue
                plan, feedback = self.manager.process(proposal)
                # Feedback first: the scheduler must know the step's shape before its result arrives.
                await self.to_scheduler.send(feedback)
                await self.to_executor.send(plan)
