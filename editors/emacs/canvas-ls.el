;;; canvas-ls.el --- canvas-ls with eglot or lsp-mode  -*- lexical-binding: t; -*-
;; Both clients get canvas-ls's suggestion through textDocument/completion: one completion-at-point item (also
;; what company and corfu show). Neither client shows LSP inline (ghost-text) completions.
;; Driven for real by tests/test_emacs.py: Emacs 28 with eglot 1.9 (Debian's emacs-nox and elpa-eglot).
;;
;; Usage: (require 'canvas-ls), then M-x eglot in a Python buffer (or `eglot-ensure' in the mode's hook).

(defgroup canvas-ls nil
  "Code completion from a text-diffusion model."
  :group 'tools)

(defcustom canvas-ls-command '("canvas-ls" "serve")
  "Command that starts the canvas-ls language server."
  :type '(repeat string))

(defcustom canvas-ls-initialization-options '(:engine (:device "auto"))
  "Options sent to the server at start (its README lists them), as a plist.
For example \\='(:engine (:model \"/path/to/model\" :device \"cpu\")
:completion (:min_confidence 0))."
  :type 'sexp)

(defconst canvas-ls-modes
  '(python-mode python-ts-mode go-mode go-ts-mode js-mode js-ts-mode typescript-ts-mode rust-mode rust-ts-mode
    c-mode c-ts-mode c++-mode c++-ts-mode java-mode lua-mode)
  "Major modes canvas-ls serves.")

(defun canvas-ls-eglot-contact (&optional _interactive)
  "The eglot contact: `canvas-ls-command' with `canvas-ls-initialization-options', read when a server starts."
  (append canvas-ls-command (list :initializationOptions canvas-ls-initialization-options)))

;;; eglot (built into Emacs 29+; the elpa-eglot package on Emacs 28)
(with-eval-after-load 'eglot
  (add-to-list 'eglot-server-programs (cons canvas-ls-modes #'canvas-ls-eglot-contact)))

(defun canvas-ls-learn-workspace (&optional folder)
  "Tune canvas-ls's model on the repository of FOLDER (default: the project's root) in the background.
The server trains at the lowest CPU priority and says when the repository's files use the new model."
  (interactive (list (read-directory-name "Learn folder: " (canvas-ls--project-root))))
  (let* ((server (eglot-current-server))
         (root (expand-file-name (or folder (canvas-ls--project-root)))))
    (unless server (user-error "canvas-ls: no eglot server in this buffer"))
    (let ((result (jsonrpc-request server :workspace/executeCommand
                                   (list :command "canvas-ls.learnWorkspace"
                                         :arguments (vector (list :folder (concat "file://" root)))))))
      (if (plist-get result :error)
          (user-error "canvas-ls: %s" (plist-get result :error))
        (message "canvas-ls: learning %s for %s min in the background"
                 (plist-get result :workspace) (plist-get result :minutes)))
      result)))

(defun canvas-ls--project-root ()
  (let ((project (project-current)))
    (if project (project-root project) default-directory)))

;;; lsp-mode
(with-eval-after-load 'lsp-mode
  (lsp-register-client
   (make-lsp-client
    :new-connection (lsp-stdio-connection (lambda () canvas-ls-command))
    :activation-fn (lsp-activate-on "python" "go" "javascript" "typescript" "rust" "c" "cpp" "java" "lua")
    :initialization-options (lambda () canvas-ls-initialization-options)
    :add-on? t  ; alongside your language's own server
    :server-id 'canvas-ls)))

(provide 'canvas-ls)
;;; canvas-ls.el ends here
