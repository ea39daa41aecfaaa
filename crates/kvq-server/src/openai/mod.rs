//! The OpenAI wire types: what clients send (`request`) and what the server answers (`response`).

pub mod request;
pub mod response;

pub use request::{ChatCompletionRequest, CompletionRequest, InputMessage, StreamOptions};
pub use response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
    ChatTokenLogprob, CompletionChoice, CompletionLogprobs, ModelCard, ModelList, ResponseMessage,
    TextCompletion, TopLogprobOut, UsageOut,
};
pub use response::{FunctionOut, ToolCallDelta, ToolCallOut};
