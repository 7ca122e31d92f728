#include "text/jinja/content_format.h"

#include <algorithm>
#include <deque>
#include <set>
#include <string>
#include <vector>

namespace tandem::text::jinja {
namespace {

// Every `for` and every `{% set name = expr %}` in the template, at any depth (macros, blocks).
struct Statements {
  std::vector<const Stmt*> loops;
  std::vector<const Stmt*> assignments;

  void collect(const Body& body) {
    for (const auto& s : body) {
      if (s->kind == StmtKind::kFor) loops.push_back(s.get());
      if (s->kind == StmtKind::kSet) assignments.push_back(s.get());
      collect(s->body);
      collect(s->else_body);
    }
  }
};

bool is_name(const Expr* e, const std::string& name) {
  return e && e->kind == ExprKind::kName && e->name == name;
}

// `var['key']` or `var.key`.
bool is_item(const Expr* e, const std::string& var, const std::string& key) {
  if (!e || e->children.empty() || !is_name(e->children[0].get(), var)) return false;
  if (e->kind == ExprKind::kGetAttr) return e->name == key;
  if (e->kind != ExprKind::kGetItem || e->children.size() < 2) return false;
  const Expr* index = e->children[1].get();
  return index && index->kind == ExprKind::kConst && index->value.is_string() &&
         index->value.s.view() == key;
}

// `var` (or `var['key']`), possibly filtered (`messages|selectattr(...)`), tested or sliced
// (`messages[1:]`): what still yields the same elements when iterated.
bool reads(const Expr* e, const std::string& var, const std::string& key) {
  if (!e) return false;
  if (e->kind == ExprKind::kFilter || e->kind == ExprKind::kTest)
    return !e->children.empty() && reads(e->children[0].get(), var, key);
  if (e->kind == ExprKind::kGetItem && e->children.size() >= 2 && e->children[1] &&
      e->children[1]->kind == ExprKind::kSlice)
    return reads(e->children[0].get(), var, key);
  return key.empty() ? is_name(e, var) : is_item(e, var, key);
}

// `content`, `x.content` or `x['content']`, whatever `x` is.
bool is_content(const Expr* e) {
  if (!e) return false;
  if (e->kind == ExprKind::kName || e->kind == ExprKind::kGetAttr) return e->name == "content";
  if (e->kind != ExprKind::kGetItem || e->children.size() < 2 || !e->children[1]) return false;
  const Expr* index = e->children[1].get();
  return index->kind == ExprKind::kConst && index->value.is_string() &&
         index->value.s.view() == "content";
}

// Whether `found` holds for an expression of `e`, itself or any it contains. Recursion is bounded
// by the parser's limit on a tree's height.
template <class Found>
bool any_expr(const Expr* e, const Found& found) {
  if (!e) return false;
  if (found(*e)) return true;
  for (const auto& c : e->children)
    if (any_expr(c.get(), found)) return true;
  for (const auto& [name, value] : e->kwargs)
    if (any_expr(value.get(), found)) return true;
  return false;
}

// Whether `found` holds for an expression anywhere in the template (macros and blocks included).
template <class Found>
bool any_expr(const Body& body, const Found& found) {
  for (const auto& s : body) {
    for (const Expr* e : {s->expr.get(), s->target.get(), s->filter.get()})
      if (any_expr(e, found)) return true;
    for (const auto* list : {&s->filters, &s->defaults})
      for (const auto& e : *list)
        if (any_expr(e.get(), found)) return true;
    if (any_expr(s->body, found) || any_expr(s->else_body, found)) return true;
  }
  return false;
}

// `<content> is [not] none`.
bool tests_none(const Expr& e) {
  return e.kind == ExprKind::kTest && e.name == "none" && !e.children.empty() &&
         is_content(e.children[0].get());
}

// `x['arguments']` or `x.arguments`, whatever `x` is.
bool is_arguments(const Expr* e) {
  if (!e || e->children.empty()) return false;
  if (e->kind == ExprKind::kGetAttr) return e->name == "arguments";
  if (e->kind != ExprKind::kGetItem || e->children.size() < 2 || !e->children[1]) return false;
  const Expr* index = e->children[1].get();
  return index->kind == ExprKind::kConst && index->value.is_string() &&
         index->value.s.view() == "arguments";
}

// `<arguments> + ...` or `... + <arguments>`.
bool adds_arguments(const Expr& e) {
  return e.kind == ExprKind::kBinary && e.name == "+" &&
         std::any_of(e.children.begin(), e.children.end(),
                     [](const auto& c) { return is_arguments(c.get()); });
}

}  // namespace

bool tests_content_for_none(const Body& body) {
  return any_expr(body, tests_none);
}

bool concatenates_tool_arguments(const Body& body) {
  return any_expr(body, adds_arguments);
}

ContentFormat detect_content_format(const Body& body) {
  Statements all;
  all.collect(body);

  // The names the message list goes by: `messages` and whatever is set from it, transitively.
  std::set<std::string> lists = {"messages"};
  std::deque<std::string> pending = {"messages"};
  while (!pending.empty()) {
    const std::string var = pending.front();
    pending.pop_front();
    for (const Stmt* s : all.assignments) {
      if (!reads(s->expr.get(), var, "")) continue;
      if (!s->target || s->target->kind != ExprKind::kName) return ContentFormat::kString;
      if (lists.insert(s->target->name).second) pending.push_back(s->target->name);
    }
  }

  // The loop variables that take each message.
  std::set<std::string> messages;
  for (const Stmt* loop : all.loops)
    for (const std::string& list : lists) {
      if (!reads(loop->expr.get(), list, "")) continue;
      if (!loop->target || loop->target->kind != ExprKind::kName) return ContentFormat::kString;
      messages.insert(loop->target->name);
      break;
    }

  for (const Stmt* loop : all.loops) {
    bool over_content = is_name(loop->expr.get(), "content");
    for (const std::string& message : messages)
      over_content = over_content || reads(loop->expr.get(), message, "content");
    if (!over_content) continue;
    if (!loop->target || loop->target->kind != ExprKind::kName) return ContentFormat::kString;
    return ContentFormat::kOpenAI;
  }
  return ContentFormat::kString;
}

}  // namespace tandem::text::jinja
