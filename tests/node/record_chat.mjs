// An ordinary tool loop on the official `openai` npm package; the gateway's record mode keeps its event log.
// Nothing here knows about sessionlog: only the base URL points at the gateway, `/record/{sessionId}/v1`.
// The first turn is streamed, the second is not; each pushes the assistant message the SDK returned, as it is.
//
//   node record_chat.mjs SESSION_ID   # GATEWAY_URL (default http://127.0.0.1:8470), MODEL
import OpenAI from "openai";

const sessionId = process.argv[2];
const gateway = process.env.GATEWAY_URL ?? "http://127.0.0.1:8470";
const client = new OpenAI({
  baseURL: `${gateway}/record/${sessionId}/v1`,
  apiKey: process.env.GATEWAY_API_KEY ?? "unused",
});
const model = process.env.MODEL ?? "deepseek-chat";

const tools = [
  {
    type: "function",
    function: {
      name: "add",
      description: "Add two integers.",
      parameters: {
        type: "object",
        properties: { a: { type: "integer" }, b: { type: "integer" } },
        required: ["a", "b"],
      },
    },
  },
];
const add = ({ a, b }) => a + b;
const messages = [{ role: "system", content: "You are a careful assistant. Use the add tool for sums." }];

async function ask(stream) {
  if (!stream) {
    const completion = await client.chat.completions.create({ model, messages, tools });
    return completion.choices[0].message;
  }
  const events = client.chat.completions.stream({ model, messages, tools, stream_options: { include_usage: true } });
  events.on("content", (delta) => process.stdout.write(delta));
  const completion = await events.finalChatCompletion();
  process.stdout.write("\n");
  return completion.choices[0].message;
}

async function turn(question, stream) {
  messages.push({ role: "user", content: question });
  for (;;) {
    const message = await ask(stream);
    messages.push(message); // the SDK's own object goes back into the history
    if (!message.tool_calls?.length) return message.content;
    for (const call of message.tool_calls) {
      const result = add(JSON.parse(call.function.arguments));
      messages.push({ role: "tool", tool_call_id: call.id, content: String(result) });
    }
  }
}

console.log("answer:", await turn("What is 2 + 3?", true));
console.log("answer:", await turn("And that doubled?", false));
