"""Pydantic models of the API's constraints on the output: OpenAI's `response_format` and tools (request and
response shapes), and vLLM's `structured_outputs` object. Kept apart from protocol.py, which imports them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagellm.sampling_params import StructuredOutputsParams

# vLLM's removed request fields -> what replaces them (a 400 names it: vLLM now ignores them, which fails open).
REMOVED_GUIDED_FIELDS = {
    "guided_json": 'structured_outputs: {"json": <schema>} (or response_format json_schema)',
    "guided_regex": 'structured_outputs: {"regex": <pattern>}',
    "guided_choice": 'structured_outputs: {"choice": [<strings>]}',
    "guided_grammar": 'structured_outputs: {"grammar": <Lark or GBNF>}',
    "guided_decoding_backend": "nothing: the backend is llguidance",
    "guided_whitespace_pattern": 'structured_outputs: {"disable_any_whitespace": true}',
}


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request object (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None

    model_config = ConfigDict(populate_by_name=True)

    def to_params(self) -> StructuredOutputsParams:
        """Raises InvalidRequestError when not exactly one constraint is set."""
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace,
                                       disable_additional_properties=self.disable_additional_properties)


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            schema = self.json_schema.json_schema if self.json_schema is not None else None
            # OpenAI requires the schema; without one any JSON object is the honest reading.
            return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(
                json_object=True)
        return None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
