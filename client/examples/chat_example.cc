// A small program to copy from: connect to fwserve, create a session, stream a
// generation into it, then continue the same session (the server keeps the recurrent
// state, so the second request does not resend the first one's text).
//
//   fwserve_chat_example [HOST:PORT]        (default 127.0.0.1:50051)
//
// Built in-tree as fwserve_chat_example; out of tree, link fwserve::client from
// find_package(fwserve) (see docs/client.md).
#include <cstdio>
#include <memory>
#include <string>

#include "client/client.h"

namespace v1 = fwserve::v1;

namespace {

int Fail(const char* what, const absl::Status& status) {
  // status.code() is the gRPC code (NOT_FOUND, UNAVAILABLE, ...), status.message() the
  // server's explanation.
  std::fprintf(stderr, "%s failed: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  fwserve::ClientOptions options;
  if (argc > 1) options.target = argv[1];
  options.deadline = absl::Seconds(10);  // unary calls; Generate streams have none
  absl::StatusOr<std::unique_ptr<fwserve::Client>> connected = fwserve::Client::Connect(options);
  if (!connected.ok()) return Fail("Connect", connected.status());
  fwserve::Client& client = **connected;

  // 1. A session, prefilled with some text.
  absl::StatusOr<v1::SessionInfo> session = client.CreateSession(/*model=*/"", "ROMEO:\n");
  if (!session.ok()) return Fail("CreateSession", session.status());
  std::printf("session %s (model %s, %lld tokens)\n", session->session_id().c_str(),
              session->model().c_str(), static_cast<long long>(session->tokens()));

  // 2. Stream a generation into it, printing text as it arrives.
  v1::GenerateRequest request;
  request.set_session_id(session->session_id());
  request.set_prompt("But soft, what light");
  request.set_max_tokens(80);
  request.mutable_sampling()->set_temperature(0.8f);
  request.mutable_sampling()->set_seed(42);
  request.add_stop("\n\n");
  std::printf("--- first turn\n");
  absl::StatusOr<fwserve::GenerateResult> first =
      client.Generate(request, [](const v1::GenerateResponse& message) {
        std::fputs(message.text().c_str(), stdout);
        std::fflush(stdout);
        return true;  // false would cancel the stream
      });
  if (!first.ok()) return Fail("Generate", first.status());
  std::printf("\n--- %d tokens, session now holds %lld\n",
              static_cast<int>(first->token_ids.size()),
              static_cast<long long>(first->usage.session_tokens()));

  // 3. Continue the same session with the iterator form: only the new text is sent.
  request.set_prompt("\nJULIET:\n");
  std::unique_ptr<fwserve::GenerateStream> stream = client.StartGenerate(request);
  v1::GenerateResponse message;
  v1::Usage usage;
  std::printf("--- second turn\n");
  while (stream->Next(&message)) {
    std::fputs(message.text().c_str(), stdout);
    std::fflush(stdout);
    if (message.has_usage()) usage = message.usage();
  }
  if (absl::Status status = stream->Finish(); !status.ok()) return Fail("Generate", status);
  std::printf("\n--- session now holds %lld tokens\n",
              static_cast<long long>(usage.session_tokens()));

  // 4. Sessions live on the server until deleted (or until their idle TTL).
  if (absl::Status status = client.DeleteSession(session->session_id()); !status.ok()) {
    return Fail("DeleteSession", status);
  }
  return 0;
}
