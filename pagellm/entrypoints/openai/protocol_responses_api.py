"""Pydantic models of OpenAI's Responses API (`/v1/responses`) request: as OpenAI's clients send it (input items,
function tools in their flat shape, `text.format`). The items a later input may send back (messages, function
calls, reasoning) are defined here; what the server sends (the response object, its stream events) is in
protocol_responses_api_output.py, and protocol_responses.py holds the bodies of the other endpoints.
serving_responses.py maps a request onto the chat path.

Validation as on the other routes: finite floats in OpenAI's ranges, items told apart by their `type` (an image, a
file or a hosted tool is a 400 naming where it is), and fields that would change the result but are not
implemented are refused with a 400 naming them. Hints that change nothing here (`metadata`, `service_tier`,
`user`, ...) are accepted."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol import MAX_TOOLS, PositiveInt64, RequestModel
from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel

# How many `store: true` responses the server keeps (--max-stored-responses; here, light to import for the CLI).
DEFAULT_MAX_STORED_RESPONSES = 1024


# ---- input items ------------------------------------------------------------------------------------------------
class InputText(OpenAIBaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


TextPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(OpenAIBaseModel):
    """A message of the conversation (OpenAI's EasyInputMessage, whose `type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made (in an output, or sent back in a later input)."""

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    call_id: str
    output: str | list[InputText]
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The model's reasoning (with --reasoning-parser). Sent back in a later input it is dropped, as chat templates
    drop the reasoning of earlier turns."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


# ---- request ----------------------------------------------------------------------------------------------------
class FunctionTool(OpenAIBaseModel):
    """A function tool in the Responses API's flat shape (no nested `function` object)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormatText(OpenAIBaseModel):
    type: Literal["text"]


class TextFormatJSONObject(OpenAIBaseModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(OpenAIBaseModel):
    type: Literal["json_schema"]
    name: str
    # `schema` shadows a BaseModel attribute: stored as json_schema, read and written as "schema".
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = {**OpenAIBaseModel.model_config, "populate_by_name": True, "serialize_by_alias": True}


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=lambda: TextFormatText(type="text"))


class ReasoningConfig(OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestModel):
    # Field -> why it is refused when set to anything but a neutral value (None, false, "", [], {}).
    unsupported_fields: ClassVar[dict[str, str]] = {
        "background": "background responses are not implemented",
        "conversation": "conversations are not implemented; use previous_response_id",
        "prompt": "prompt templates are not implemented",
        "include": "no extra output data (include) is implemented",
        "top_logprobs": "logprobs are not implemented on /v1/responses; use /v1/chat/completions",
        "max_tool_calls": "max_tool_calls is not implemented",
    }

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = False  # stateless unless asked: only a stored response can be continued or retrieved
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the oldest items) is not implemented
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in cls.unsupported_fields.items():
                if data.get(name) not in (None, False, "", [], {}):
                    raise PydanticCustomError("unsupported_field", "{field} is not supported: {reason}",
                                              {"field": name, "reason": reason})
            tools = data.get("tools")
            for i, tool in enumerate(tools if isinstance(tools, list) else []):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise PydanticCustomError("unsupported_field", "{field}: only function tools are served here, "
                                              "not {type!r}", {"field": f"tools.{i}", "type": tool.get("type")})
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        choice = self.tool_choice
        if choice not in (None, "none", "auto"):
            if not self.tools:
                raise PydanticCustomError("invalid_field", "{field} needs tools to choose from",
                                          {"field": "tool_choice"})
            if isinstance(choice, FunctionToolChoice) and choice.name not in {tool.name for tool in self.tools}:
                raise PydanticCustomError("invalid_field", "{field} names function {name!r}, which is not in tools",
                                          {"field": "tool_choice", "name": choice.name})
            if self.text is not None and self.text.format.type != "text":
                raise PydanticCustomError("invalid_field", "{field} forces a tool call, which already constrains "
                                          "the output; drop text.format", {"field": "tool_choice"})
        return self
