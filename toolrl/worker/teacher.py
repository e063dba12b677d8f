"""Teacher samples: a task's teacher trace (toolrl.tasks.TeacherTrace) laid out as a Sample that
the SFT term learns.

A tool trace (the arithmetic teacher's) is built from the same pieces as a rollout (model segments,
the program's real output *from the executor service* as a tool segment tokenised by
`tool_segment_ids`), so it teaches exactly the token layout rollouts produce, and the tool output
is masked out of the SFT loss like any tool output. A plain trace (the code teacher's) is learned
whole.
"""
from __future__ import annotations

from toolrl.protocol import Sample, ToolCall
from toolrl.tasks import TeacherTrace
from toolrl.worker.rollout import Tool, tool_output_text, tool_segment_ids


async def teacher_sample(trace: TeacherTrace | None, prompt_ids: list[int], tokenizer, tool: Tool,
                         max_tool_output_tokens: int, group_id: str, policy_version: int,
                         prefill: str = "") -> Sample | None:
    """One trace as a Sample (source 'teacher'). None without a trace, or when the executor's output
    disagrees with the known answer (then there is nothing to teach)."""
    if trace is None:
        return None
    if trace.program is None:
        text = trace.text[len(prefill):] if prefill and trace.text.startswith(prefill) else trace.text
        ids = tokenizer.encode(text, add_special_tokens=False)  # the prompt already ends with the prefill
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return _sample(prompt_ids, ids, [1] * len(ids), [0.0] * len(ids), [], prefill + text, group_id,
                       policy_version)
    call = await tool.run(trace.program, None)
    if call.status != "ok" or call.output.strip() != trace.expect:
        return None
    head_ids = tokenizer.encode(trace.text, add_special_tokens=False)
    tool_ids = tool_segment_ids(tokenizer, tool_output_text(call), max_tool_output_tokens)
    tail_ids = tokenizer.encode(trace.conclusion(call.output.strip()), add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        tail_ids.append(tokenizer.eos_token_id)  # the trace ends the turn, as a finished rollout does
    ids = head_ids + tool_ids + tail_ids
    mask = [1] * len(head_ids) + [0] * len(tool_ids) + [1] * len(tail_ids)
    return _sample(prompt_ids, ids, mask, [0.0 if m else None for m in mask], [call],
                   tokenizer.decode(ids, skip_special_tokens=True), group_id, policy_version)


def _sample(prompt_ids: list[int], ids: list[int], mask: list[int], logprobs: list, calls: list[ToolCall],
            text: str, group_id: str, policy_version: int) -> Sample:
    # logprobs: not sampled, so never used as behaviour logprobs
    return Sample(prompt_ids=prompt_ids, completion_ids=ids, loss_mask=mask, logprobs=logprobs,
                  rewards={"correct": 1.0}, reward=1.0, advantage=0.0, group_id=group_id,
                  policy_version=policy_version, source="teacher", stop_reason="eos", tool_calls=calls, text=text)
