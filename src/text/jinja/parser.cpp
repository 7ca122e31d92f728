// Recursive-descent parser mirroring jinja2.parser.Parser, restricted to the statements chat
// templates use.
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <set>

#include "text/jinja/ast.h"
#include "text/jinja/builtins.h"
#include "text/jinja/lexer.h"
#include "util/error.h"

namespace tandem::text::jinja {
namespace {

// Statements real Jinja2 knows but this interpreter does not implement.
const std::set<std::string, std::less<>> kUnsupportedTags = {
    "extends",    "block",   "include",       "import",  "from",     "with",
    "autoescape", "call",    "raw",           "do",      "trans",    "pluralize",
    "endblock",   "endwith", "endautoescape", "endcall", "endtrans", "debug"};

// jinja2.compiler's find_undeclared(macro.body, ("varargs", "kwargs")): walking the body in
// jinja2.nodes field order (nested macros included), a name whose first occurrence reads it is
// undeclared; one assigned first, or a nested macro's parameter, is not.
class UndeclaredNames {
 public:
  // 0: not seen yet; 1: read first; -1: assigned first.
  int varargs = 0, kwargs = 0;

  void body(const Body& b) {
    for (const auto& s : b) stmt(*s);
  }

 private:
  void name(const std::string& n, int how) {
    if (n == "varargs" && varargs == 0) varargs = how;
    if (n == "kwargs" && kwargs == 0) kwargs = how;
  }
  void expr(const Expr* e, bool store = false) {
    if (!e) return;
    if (e->kind == ExprKind::kName) return name(e->name, store ? -1 : 1);
    if (e->kind == ExprKind::kNsRef) return;  // `ns.attr =`: no name node in jinja2 either
    for (const auto& c : e->children) expr(c.get(), store && e->kind == ExprKind::kTuple);
    for (const auto& [k, v] : e->kwargs) expr(v.get());
  }
  void stmt(const Stmt& s) {
    switch (s.kind) {
      case StmtKind::kData:
      case StmtKind::kBreak:
      case StmtKind::kContinue:
        return;
      case StmtKind::kOutput:
        return expr(s.expr.get());
      case StmtKind::kIf:  // If(test, body, elif_, else_)
        expr(s.expr.get());
        body(s.body);
        return body(s.else_body);
      case StmtKind::kFor:  // For(target, iter, body, else_, test)
        expr(s.target.get(), true);
        expr(s.expr.get());
        body(s.body);
        body(s.else_body);
        return expr(s.filter.get());
      case StmtKind::kSet:  // Assign(target, node)
        expr(s.target.get(), true);
        return expr(s.expr.get());
      case StmtKind::kSetBlock:  // AssignBlock(target, filter, body)
        expr(s.target.get(), true);
        for (const auto& f : s.filters) expr(f.get());
        return body(s.body);
      case StmtKind::kMacro:  // Macro(name, args, defaults, body)
        for (const auto& p : s.params) name(p, -1);
        for (const auto& d : s.defaults) expr(d.get());
        return body(s.body);
      case StmtKind::kFilterBlock:  // FilterBlock(body, filter)
        body(s.body);
        for (const auto& f : s.filters) expr(f.get());
        return;
      case StmtKind::kScope:
        return body(s.body);
    }
  }
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse() {
    Body body = subparse({});
    if (cur().type != TokenType::kEnd) fail("unexpected tag '" + cur().value + "'");
    return body;
  }

 private:
  const Token& cur() const { return tokens_[pos_]; }
  const Token& look() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }

  [[noreturn]] void fail(const std::string& message) const {
    throw Error(line_message(cur().line, message));
  }
  [[noreturn]] void unsupported(const std::string& message) const {
    throw Error(line_message(cur().line, "unsupported " + message));
  }

  bool is_op(const char* op) const {
    return cur().type == TokenType::kOperator && cur().value == op;
  }
  bool is_name(const char* name) const {
    return cur().type == TokenType::kName && cur().value == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }

  std::string describe(const Token& t) const {
    switch (t.type) {
      case TokenType::kEnd:
        return "end of template";
      case TokenType::kBlockEnd:
        return "end of statement block";
      case TokenType::kVariableEnd:
        return "end of print statement";
      case TokenType::kData:
        return "template data";
      case TokenType::kString:
        return "string";
      case TokenType::kBlockBegin:
        return "begin of statement block";
      case TokenType::kVariableBegin:
        return "begin of print statement";
      default:
        return "'" + t.value + "'";
    }
  }

  void expect_op(const char* op) {
    if (!skip_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != TokenType::kName) fail("expected a name, got " + describe(cur()));
    std::string v = cur().value;
    next();
    return v;
  }
  void expect_block_end() {
    if (cur().type != TokenType::kBlockEnd) {
      fail("expected end of statement block, got " + describe(cur()));
    }
    next();
  }

  std::unique_ptr<Expr> make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // ---- statements ----

  // Parses until a block tag whose name is in `end_tags` (left as the current token) or the end.
  Body subparse(std::initializer_list<const char*> end_tags) {
    Body body;
    while (cur().type != TokenType::kEnd) {
      const Token& t = cur();
      if (t.type == TokenType::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kData;
        s->line = t.line;
        s->text = t.value;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->expr = parse_tuple(false, true, {}, false);
        if (cur().type != TokenType::kVariableEnd) {
          fail("expected end of print statement, got " + describe(cur()));
        }
        next();
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        if (cur().type == TokenType::kName) {
          for (const char* end : end_tags) {
            if (cur().value == end) return body;
          }
        }
        body.push_back(parse_statement());
        expect_block_end();
      } else {
        fail("unexpected " + describe(t));
      }
    }
    return body;
  }

  // After the statement's own header: expects `%}`, parses the body up to one of `end_tags`.
  Body parse_statements(std::initializer_list<const char*> end_tags, bool drop_needle) {
    const Nesting nesting(*this);
    expect_block_end();
    Body body = subparse(end_tags);
    if (cur().type == TokenType::kEnd) {
      std::string names;
      for (const char* e : end_tags)
        names += std::string(names.empty() ? "" : " or ") + "'" + e + "'";
      fail("unexpected end of template, expected " + names);
    }
    if (drop_needle) next();
    return body;
  }

  std::unique_ptr<Stmt> parse_statement() {
    if (cur().type != TokenType::kName) fail("tag name expected");
    std::string tag = cur().value;
    int line = cur().line;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") {
      next();
      parse_if(*s);
    } else if (tag == "for") {
      next();
      parse_for(*s);
    } else if (tag == "set") {
      next();
      parse_set(*s);
    } else if (tag == "macro") {
      next();
      parse_macro(*s);
    } else if (tag == "break" || tag == "continue") {
      next();
      if (loop_depth_ == 0) fail("'" + tag + "' outside of a loop");
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
    } else if (tag == "filter") {
      next();
      s->kind = StmtKind::kFilterBlock;
      parse_filter_chain(s->filters, line, true);
      s->body = parse_statements({"endfilter"}, true);
    } else if (tag == "generation") {
      next();
      s->kind = StmtKind::kScope;
      s->body = parse_statements({"endgeneration"}, true);
    } else if (kUnsupportedTags.count(tag)) {
      fail("unsupported tag '" + tag + "'");
    } else {
      fail("unknown tag '" + tag + "'");
    }
    return s;
  }

  void parse_if(Stmt& s) {
    const Nesting nesting(*this);  // an elif nests the next if in this one's else
    s.kind = StmtKind::kIf;
    s.expr = parse_tuple(false, false, {}, false);
    s.body = parse_statements({"elif", "else", "endif"}, false);
    std::string tag = cur().value;
    int line = cur().line;
    next();
    if (tag == "elif") {
      auto nested = std::make_unique<Stmt>();
      nested->line = line;
      parse_if(*nested);
      s.else_body.push_back(std::move(nested));
      return;  // the nested if consumed the endif
    }
    if (tag == "else") s.else_body = parse_statements({"endif"}, true);
  }

  void parse_for(Stmt& s) {
    s.kind = StmtKind::kFor;
    s.target = parse_assign_target(true, {"in"}, false);
    if (!skip_name("in")) fail("expected 'in', got " + describe(cur()));
    s.expr = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) s.filter = parse_expression(true);
    if (is_name("recursive")) unsupported("recursive for loop");
    ++loop_depth_;
    s.body = parse_statements({"endfor", "else"}, false);
    --loop_depth_;
    std::string tag = cur().value;
    next();
    if (tag == "else") s.else_body = parse_statements({"endfor"}, true);
  }

  void parse_set(Stmt& s) {
    s.target = parse_assign_target(true, {}, true);
    if (skip_op("=")) {
      s.kind = StmtKind::kSet;
      s.expr = parse_tuple(false, true, {}, false);
      return;
    }
    s.kind = StmtKind::kSetBlock;
    if (s.target->kind == ExprKind::kNsRef) unsupported("block set of a namespace attribute");
    parse_filter_chain(s.filters, s.line, false);
    s.body = parse_statements({"endset"}, true);
  }

  void parse_macro(Stmt& s) {
    s.kind = StmtKind::kMacro;
    s.name = expect_name();
    expect_op("(");
    bool seen_default = false;
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string param = expect_name();
      if (param == "caller" || param == "varargs" || param == "kwargs") {
        unsupported("macro parameter '" + param + "'");
      }
      s.params.push_back(param);
      if (skip_op("=")) {
        s.defaults.push_back(parse_expression(true));
        seen_default = true;
      } else {
        if (seen_default) fail("non-default argument follows default argument");
        s.defaults.push_back(nullptr);
      }
    }
    expect_op(")");
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;  // break/continue cannot cross a macro boundary
    s.body = parse_statements({"endmacro"}, true);
    loop_depth_ = saved_loop_depth;
    UndeclaredNames undeclared;
    undeclared.body(s.body);
    s.catch_varargs = undeclared.varargs == 1;
    s.catch_kwargs = undeclared.kwargs == 1;
  }

  // `f(args) | g` after {% filter %} (start_inline) or `| f | g` after a block {% set x %}.
  void parse_filter_chain(std::vector<std::unique_ptr<Expr>>& out, int line, bool start_inline) {
    while (start_inline || skip_op("|")) {
      start_inline = false;
      auto f = make(ExprKind::kFilter, line);
      f->children.push_back(nullptr);
      parse_filter_call(*f);
      out.push_back(std::move(f));
    }
  }

  // ---- expressions ----

  bool is_tuple_end(std::initializer_list<const char*> extra_end) const {
    if (cur().type == TokenType::kVariableEnd || cur().type == TokenType::kBlockEnd || is_op(")")) {
      return true;
    }
    for (const char* e : extra_end) {
      if (is_name(e)) return true;
    }
    return false;
  }

  std::unique_ptr<Expr> parse_tuple(bool simplified, bool with_condexpr,
                                    std::initializer_list<const char*> extra_end,
                                    bool explicit_parentheses) {
    int line = cur().line;
    std::vector<std::unique_ptr<Expr>> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      if (simplified) {
        args.push_back(parse_primary());
      } else {
        args.push_back(parse_expression(with_condexpr));
      }
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses) fail("expected an expression, got " + describe(cur()));
    }
    auto t = make(ExprKind::kTuple, line);
    t->children = std::move(args);
    return measured(std::move(t));
  }

  std::unique_ptr<Expr> parse_assign_target(bool with_tuple,
                                            std::initializer_list<const char*> extra_end,
                                            bool with_namespace) {
    int line = cur().line;
    if (with_namespace && cur().type == TokenType::kName && look().type == TokenType::kOperator &&
        look().value == ".") {
      auto t = make(ExprKind::kNsRef, line);
      t->name = expect_name();
      next();  // the dot
      t->attr = expect_name();
      return t;
    }
    std::unique_ptr<Expr> target =
        with_tuple ? parse_tuple(true, true, extra_end, false) : parse_primary();
    auto assignable = [](const Expr& e) {
      return e.kind == ExprKind::kName && e.name != "true" && e.name != "false" &&
             e.name != "none" && e.name != "True" && e.name != "False" && e.name != "None";
    };
    bool ok = assignable(*target);
    if (target->kind == ExprKind::kTuple) {
      ok = true;
      for (const auto& c : target->children) ok = ok && assignable(*c);
    }
    if (!ok) throw Error(line_message(line, "can't assign to this expression"));
    return target;
  }

  std::unique_ptr<Expr> parse_expression(bool with_condexpr) {
    const Nesting nesting(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  std::unique_ptr<Expr> parse_condexpr() {
    int line = cur().line;
    auto expr1 = parse_or();
    while (skip_name("if")) {
      auto expr2 = parse_or();
      std::unique_ptr<Expr> expr3;
      if (skip_name("else")) {
        const Nesting nesting(*this);  // `a if x else b if y else ...` recurses per else
        expr3 = parse_condexpr();
      }
      auto c = make(ExprKind::kCond, line);
      c->children.push_back(std::move(expr2));
      c->children.push_back(std::move(expr1));
      c->children.push_back(std::move(expr3));
      expr1 = measured(std::move(c));
    }
    return expr1;
  }

  std::unique_ptr<Expr> binary(ExprKind kind, std::unique_ptr<Expr> l, std::unique_ptr<Expr> r,
                               int line, std::string op = {}) {
    auto e = make(kind, line);
    e->name = std::move(op);
    e->children.push_back(std::move(l));
    e->children.push_back(std::move(r));
    return measured(std::move(e));
  }

  std::unique_ptr<Expr> parse_or() {
    int line = cur().line;
    auto left = parse_and();
    while (skip_name("or")) left = binary(ExprKind::kOr, std::move(left), parse_and(), line);
    return left;
  }

  std::unique_ptr<Expr> parse_and() {
    int line = cur().line;
    auto left = parse_not();
    while (skip_name("and")) left = binary(ExprKind::kAnd, std::move(left), parse_not(), line);
    return left;
  }

  std::unique_ptr<Expr> parse_not() {
    const Nesting nesting(*this);
    int line = cur().line;
    if (skip_name("not")) {
      auto e = make(ExprKind::kNot, line);
      e->children.push_back(parse_not());
      return measured(std::move(e));
    }
    return parse_compare();
  }

  std::unique_ptr<Expr> parse_compare() {
    int line = cur().line;
    auto expr = parse_math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (cur().type == TokenType::kOperator &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
           cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        op = cur().value;
        next();
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && look().type == TokenType::kName && look().value == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::kCompare, line);
        cmp->children.push_back(std::move(expr));
      }
      cmp->ops.push_back(op);
      cmp->children.push_back(parse_math1());
    }
    return cmp ? measured(std::move(cmp)) : std::move(expr);
  }

  std::unique_ptr<Expr> parse_math1() {
    int line = cur().line;
    auto left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().value;
      next();
      left = binary(ExprKind::kBinary, std::move(left), parse_concat(), line, op);
    }
    return left;
  }

  std::unique_ptr<Expr> parse_concat() {
    int line = cur().line;
    auto first = parse_math2();
    if (!is_op("~")) return first;
    auto c = make(ExprKind::kConcat, line);
    c->children.push_back(std::move(first));
    while (skip_op("~")) c->children.push_back(parse_math2());
    return measured(std::move(c));
  }

  std::unique_ptr<Expr> parse_math2() {
    int line = cur().line;
    auto left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().value;
      next();
      left = binary(ExprKind::kBinary, std::move(left), parse_pow(), line, op);
    }
    return left;
  }

  std::unique_ptr<Expr> parse_pow() {
    int line = cur().line;
    auto left = parse_unary(true);
    while (skip_op("**")) {
      left = binary(ExprKind::kBinary, std::move(left), parse_unary(true), line, "**");
    }
    return left;
  }

  std::unique_ptr<Expr> parse_unary(bool with_filter) {
    const Nesting nesting(*this);
    int line = cur().line;
    std::unique_ptr<Expr> node;
    if (skip_op("-")) {
      node = make(ExprKind::kNeg, line);
      node->children.push_back(parse_unary(false));
      measure(*node);
    } else if (skip_op("+")) {
      node = make(ExprKind::kPos, line);
      node->children.push_back(parse_unary(false));
      measure(*node);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  std::unique_ptr<Expr> parse_primary() {
    const Token& t = cur();
    int line = t.line;
    if (t.type == TokenType::kName) {
      auto e = make(ExprKind::kConst, line);
      if (t.value == "true" || t.value == "True") {
        e->value = Value::boolean(true);
      } else if (t.value == "false" || t.value == "False") {
        e->value = Value::boolean(false);
      } else if (t.value == "none" || t.value == "None") {
        e->value = Value::none();
      } else {
        e->kind = ExprKind::kName;
        e->name = t.value;
      }
      next();
      return e;
    }
    if (t.type == TokenType::kString) {
      std::string s;
      while (cur().type == TokenType::kString) {  // adjacent literals concatenate
        s += cur().value;
        next();
      }
      auto e = make(ExprKind::kConst, line);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == TokenType::kInteger || t.type == TokenType::kFloat) {
      std::string digits;
      for (char c : t.value) {
        if (c != '_') digits += c;
      }
      auto e = make(ExprKind::kConst, line);
      errno = 0;
      if (t.type == TokenType::kInteger) {
        long long v = std::strtoll(digits.c_str(), nullptr, 10);
        if (errno == ERANGE) {
          // Up to 2^64 - 1 as a request's JSON can bring them; beyond, refused.
          errno = 0;
          unsigned long long u = std::strtoull(digits.c_str(), nullptr, 10);
          if (errno == ERANGE) unsupported("integer literal out of 64-bit range");
          e->value = Value::big_integer(u);
        } else {
          e->value = Value::integer(v);
        }
      } else {
        e->value = Value::floating(std::strtod(digits.c_str(), nullptr));
      }
      next();
      return e;
    }
    if (skip_op("(")) {
      auto e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = make(ExprKind::kList, line);
      while (!is_op("]")) {
        if (!e->children.empty()) expect_op(",");
        if (is_op("]")) break;
        e->children.push_back(parse_expression(true));
      }
      expect_op("]");
      return measured(std::move(e));
    }
    if (skip_op("{")) {
      auto e = make(ExprKind::kDict, line);
      while (!is_op("}")) {
        if (!e->children.empty()) expect_op(",");
        if (is_op("}")) break;
        e->children.push_back(parse_expression(true));
        expect_op(":");
        e->children.push_back(parse_expression(true));
      }
      expect_op("}");
      return measured(std::move(e));
    }
    fail("unexpected " + describe(t));
  }

  std::unique_ptr<Expr> parse_postfix(std::unique_ptr<Expr> node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Expr> parse_filter_expr(std::unique_ptr<Expr> node) {
    while (true) {
      if (is_op("|")) {
        while (skip_op("|")) {
          auto f = make(ExprKind::kFilter, cur().line);
          f->children.push_back(std::move(node));
          parse_filter_call(*f);
          node = std::move(f);
        }
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Expr> parse_subscript(std::unique_ptr<Expr> node) {
    int line = cur().line;
    if (skip_op(".")) {
      const Token& t = cur();
      if (t.type == TokenType::kName) {
        auto e = make(ExprKind::kGetAttr, line);
        e->name = t.value;
        e->children.push_back(std::move(node));
        next();
        return measured(std::move(e));
      }
      if (t.type != TokenType::kInteger) fail("expected name or number");
      auto key = make(ExprKind::kConst, t.line);
      key->value = Value::integer(std::strtoll(t.value.c_str(), nullptr, 10));
      next();
      auto e = make(ExprKind::kGetItem, line);
      e->children.push_back(std::move(node));
      e->children.push_back(std::move(key));
      return measured(std::move(e));
    }
    expect_op("[");
    std::vector<std::unique_ptr<Expr>> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = make(ExprKind::kGetItem, line);
    e->children.push_back(std::move(node));
    if (args.size() == 1) {
      e->children.push_back(std::move(args[0]));
    } else {
      auto t = make(ExprKind::kTuple, line);
      t->children = std::move(args);
      e->children.push_back(measured(std::move(t)));
    }
    return measured(std::move(e));
  }

  std::unique_ptr<Expr> parse_subscribed() {
    int line = cur().line;
    std::vector<std::unique_ptr<Expr>> args;
    if (skip_op(":")) {
      args.push_back(nullptr);
    } else {
      auto node = parse_expression(true);
      if (!is_op(":")) return node;
      next();
      args.push_back(std::move(node));
    }
    if (is_op(":")) {
      args.push_back(nullptr);
    } else if (!is_op("]") && !is_op(",")) {
      args.push_back(parse_expression(true));
    } else {
      args.push_back(nullptr);
    }
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) {
        args.push_back(parse_expression(true));
      } else {
        args.push_back(nullptr);
      }
    } else {
      args.push_back(nullptr);
    }
    auto s = make(ExprKind::kSlice, line);
    s->children = std::move(args);
    return measured(std::move(s));
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) unsupported("*args/**kwargs in calls");
      if (cur().type == TokenType::kName && look().type == TokenType::kOperator &&
          look().value == "=") {
        std::string key = cur().value;
        next();
        next();
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail("invalid syntax for function call expression");
        e.children.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  std::unique_ptr<Expr> parse_call(std::unique_ptr<Expr> node) {
    auto e = make(ExprKind::kCall, cur().line);
    e->children.push_back(std::move(node));
    parse_call_args(*e);
    return measured(std::move(e));
  }

  // The name and arguments of a filter; children[0] (its input) is already set.
  void parse_filter_call(Expr& f) {
    f.line = cur().line;
    f.name = expect_name();
    while (skip_op(".")) {
      f.name += '.';
      f.name += expect_name();
    }
    if (!is_supported_filter(f.name)) {
      throw Error(line_message(f.line, "unsupported filter '" + f.name + "'"));
    }
    if (is_op("(")) parse_call_args(f);
    measure(f);
  }

  std::unique_ptr<Expr> parse_test(std::unique_ptr<Expr> node) {
    int line = cur().line;
    next();  // 'is'
    auto e = make(ExprKind::kTest, line);
    e->children.push_back(std::move(node));
    if (skip_name("not")) e->negated = true;
    e->name = expect_name();
    while (skip_op(".")) {
      e->name += '.';
      e->name += expect_name();
    }
    if (!is_supported_test(e->name)) {
      throw Error(line_message(line, "unsupported test '" + e->name + "'"));
    }
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t.type == TokenType::kName || t.type == TokenType::kString ||
                t.type == TokenType::kInteger || t.type == TokenType::kFloat || is_op("[") ||
                is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      // Jinja2 accepts one argument without parentheses: `x is divisibleby 3`.
      if (is_name("is")) fail("you cannot chain multiple tests with is");
      e->children.push_back(parse_postfix(parse_primary()));
    }
    return measured(std::move(e));
  }

  // Blocks, parentheses, brackets and unary operators nest by recursion, here and in the
  // interpreter: a template nested deeper than any real one (a few thousand '(' or '-') would
  // exhaust the stack. Each of the functions nesting passes through counts one level.
  static constexpr int kMaxNesting = 500;

  // Evaluating and freeing an expression recurse once per level of its tree, and chains
  // (`a + b + c`, `x.a.b`, `x | f | g`) are parsed by loops that make it one level deeper per
  // link. So each node's height counts toward the limit too, with the levels around it; a tree
  // made of several chains is as deep as all of them.
  void measure(Expr& e) {
    int below = 0;
    for (const auto& c : e.children) {
      if (c) below = std::max(below, c->height);
    }
    for (const auto& [key, value] : e.kwargs) below = std::max(below, value->height);
    e.height = below + 1;
    if (nesting_ + e.height > kMaxNesting) fail("the template nests too deeply");
  }
  std::unique_ptr<Expr> measured(std::unique_ptr<Expr> e) {
    measure(*e);
    return e;
  }
  struct Nesting {
    Parser& parser;
    explicit Nesting(Parser& p) : parser(p) {
      if (++parser.nesting_ > kMaxNesting) {
        --parser.nesting_;
        parser.fail("the template nests too deeply");
      }
    }
    ~Nesting() { --parser.nesting_; }
    Nesting(const Nesting&) = delete;
    Nesting& operator=(const Nesting&) = delete;
  };

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
};

}  // namespace

Body parse_template(const std::string& source) {
  return Parser(tokenize(source)).parse();
}

}  // namespace tandem::text::jinja
