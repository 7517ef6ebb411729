// The web playground served at GET / on the HTTP port: one self-contained HTML page
// (server/transport/http/playground/index.html, inline CSS and script, nothing fetched
// from elsewhere) compiled into the binary. It talks to the same /v1/responses and
// /fwserve/v1/sessions endpoints as any client.
#pragma once

#include "absl/strings/string_view.h"

namespace fwserve {

// The page's bytes (UTF-8 HTML); valid for the life of the process.
absl::string_view PlaygroundHtml();

}  // namespace fwserve
