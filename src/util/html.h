#pragma once
// The one HTML escape of the project: what Jinja2's `escape` filter (markupsafe) produces, so
// chat templates render identically, and safe for HTML text and quoted attribute values.
#include <string>
#include <string_view>

namespace tandem {

// & < > " ' become &amp; &lt; &gt; &#34; &#39;; everything else is kept byte for byte.
std::string html_escape(std::string_view s);

}  // namespace tandem
